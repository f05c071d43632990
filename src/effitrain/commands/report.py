"""`effitrain report`: an HTML page of one run or several, with PNGs of its main charts (report/)."""

from __future__ import annotations


def add_parser(commands) -> None:
    report = commands.add_parser("report", help="an HTML page of one run or several (curves, evaluations, confusion "
                                               "matrix, memory; several: overlaid and compared), with PNGs")
    report.add_argument("runs", nargs="+", metavar="RUN", help="the --output-dir of a train run (or of a bench: "
                                                               "its variants)")
    report.add_argument("--out", default=None, help="the page (default: RUN/report.html for one run, report.html "
                                                    "here for several); its PNGs go beside it")
    report.add_argument("--debug", action="store_true")


def main(args) -> int:
    from effitrain.report import page as report_page

    page, pngs = report_page.write(args.runs, args.out)
    written = [str(path) for path in (page, *pngs)]
    print("wrote " + (f"{', '.join(written[:-1])} and {written[-1]}" if len(written) > 1 else written[0]))
    return 0
