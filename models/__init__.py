"""The one model definition per architecture. Imports torch and titan_rl.kernels only;
knows nothing of TorchTitan or vLLM."""
