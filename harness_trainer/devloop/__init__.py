"""``harness-trainer dev``: the whole loop on a laptop, with real agents, the tiny model and no GPU."""
