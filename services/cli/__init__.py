"""The command line: `spotrl` and its subcommands, the pods' entry points, and the remote client."""
