"""One module per `effitrain` command: add_parser(subparsers) and main(args). cli.py builds the
parser from them and dispatches. saved_model is no command: the saved model predict and evaluate read."""
