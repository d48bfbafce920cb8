"""The recipes' own code, in three wings by reader.

core/        the spine every recipe imports and every copy carries
techniques/  one module per technique, imported and copied only by the recipes that show it
tools/       the planner, the copy command, the preflight estimate: never imported by a recipe, never copied
"""
