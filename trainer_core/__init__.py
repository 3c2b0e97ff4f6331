"""spotrl's training core, in rooms: `algos` (the RL math), `logprobs` (the forward pass that
scores response tokens), `rl` (the update, its strategies, the hybrid engine of colocated runs),
`models` (loading, LoRA, checkpoints, training mode), `engines` (generation), `supervised`
(SFT, reward models) and `memory` (planning and measuring it). Never imports `services`."""
