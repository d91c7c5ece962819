"""mhc_lightning: train, stress and compare mHC / HC / residual transformers."""
__version__ = "0.1.0"
