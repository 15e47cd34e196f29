"""Neural networks (``nn.Module`` only; no I/O, no ismrmrd): the MAR U-Net and its config."""

from masc_gadget.models.unet import MarModelConfig, MarNet, UNet, build_mar, image_scale

__all__ = ["MarModelConfig", "MarNet", "UNet", "build_mar", "image_scale"]
