"""One module per `effitrain` command: add_parser(subparsers) and main(args). cli.py builds the
parser from them and dispatches."""
