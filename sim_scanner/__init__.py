"""Physics simulation of paired metal / clean MRI data and the simulated scanner client."""
