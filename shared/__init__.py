"""Helpers every recipe needs and no recipe is about. Nothing here imports a recipe."""
