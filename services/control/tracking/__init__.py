"""Experiment tracking: every training iteration's figures and every held-out evaluation of a run,
sent from the state store to the trackers its spec names (``RunSpec.tracking``): TensorBoard
event files in the object store, an MLflow tracking server, Weights & Biases.

The scheduler holds one ``Tracker`` and calls ``Tracker.sync(active_runs)`` each tick; see
``services.control.tracking.sync`` for the cursors that make a restarted scheduler lose and repeat nothing.
"""
