"""The command line: `spotrl` and its subcommands, the pods' entry points, SFT and reward-model
training (the client of a remote API is ``services.client``, which this package's `spotrl runs` uses)."""
