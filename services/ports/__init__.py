"""The ports: one folder per outside system (queue, objects, reward_cache, state, launcher,
prices), each with its interface, its embedded adapter and its production adapters;
`wiring` opens the adapters that the settings name."""
