"""The data plane: rollout workers, training jobs, reward scoring, the policy versions' weights and the colocated mode."""
