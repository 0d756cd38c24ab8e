"""Aligning frozen image and text embedding spaces: GeRA, contrastive alignment alone, and ASIF; the
align stage is :mod:`repsim.align.stage`."""
