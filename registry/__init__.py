"""Learn which CPU architectures a container or SIF image supports."""
