"""Model backends of modality-gateway. torch is imported here and nowhere in gateway/."""
