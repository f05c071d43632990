"""`effitrain report`: the runs read back (runs), charts as SVG (svg) and PNG (png), the page (page)."""
