"""Model runtimes: bundles, tokenizers, our own PyTorch code for each model family (encoders, decoders,
classifiers, ViT), generation, GGUF import and the transformers fallback."""
