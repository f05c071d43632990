"""The names a user picks from, as leaf modules that import nothing of effitrain's but errors.py (for a
one-line refusal): config offers them as choices and checks them, and the packages that implement them
(tasks/) build from the same names, without config importing those packages."""
