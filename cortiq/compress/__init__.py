"""Compress (S2): DTG-MA neuron masks, the fold, Gram capture, GPTQ."""
