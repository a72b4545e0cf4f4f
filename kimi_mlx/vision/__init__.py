"""Image input for K3.1: the MoonViT3d vision tower and patchmergerv2 projector (`tower`),
their settings (`config`) and the release's image preprocessing (`preprocess`)."""
