"""spotrl's service: the planes, the ports and the command line (docs/architecture.md).

- ``cli``: ``spotrl`` and its subcommands (``python -m services`` runs it too); ``client``: the client
  of a remote API (``spotrl runs``), which imports nothing of the server.
- ``tooling``: the demo, the chaos run and the audit of an ended run.
- ``control``: the control plane (api, scheduler, cost, simulate, tracking); no torch.
- ``data``: the data plane (rollout, training, reward, colocated runs); runs ``trainer_core``.
- ``domain``: a run's spec, names, prompts, policy-version rotation and sample backlog.
- ``ports``: one folder per outside system, each with its interface and its adapters.
- ``core``: settings, the error taxonomy, and checks on what strangers send.

The import contracts in pyproject.toml keep these layers, top to bottom, and forbid cycles.
"""
