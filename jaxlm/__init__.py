"""jaxlm: the model and the training program (config, model, attention, train, checkpoint, metrics)."""
