"""The device: probes, the background sampler, policies on its readings, and the executor."""
