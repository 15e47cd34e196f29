"""MASC inference side: k-space maths, models, policies, the ISMRMRD stream gadget and server.

This package imports neither ``sim_scanner`` nor ``training``; they build on it.
"""

__version__ = "0.2.0"
