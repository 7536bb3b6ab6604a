"""Thin typer wrappers, one module per subcommand: parse options, call a library function, print."""
