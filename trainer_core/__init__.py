"""spotrl's training core: sample format, model loading, generation, RL math and the update
step. Never imports `services`."""
