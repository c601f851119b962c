"""Media: fetched safely, video sampled into frames, audio transcribed, what was converted kept."""
