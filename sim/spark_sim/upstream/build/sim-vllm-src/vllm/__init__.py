"""Stand-in vLLM package of the simulated base image (not a server)."""
__version__ = "0.19.1.dev0+gSIMREF"
