"""``trtllm-diffkv`` subcommands (one module each; listed in ``cli.COMMAND_MODULES``; :mod:`.common` holds what they share).

Each module has ``add_parser(subparsers)``: it adds its parser and calls
``parser.set_defaults(run=run)`` with ``run(args) -> int`` (0 ok, 1 a request
failed, 2 a usage or setup error, reported in one line on stderr). Heavy
imports stay inside ``run`` so that ``trtllm-diffkv --help`` stays fast.
"""
