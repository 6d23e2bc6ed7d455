"""One module per `kvspec` subcommand; each defines `register(subparsers)`."""
