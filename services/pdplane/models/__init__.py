"""Models pdplane builds locally (nothing is downloaded from a hub)."""
