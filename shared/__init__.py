"""The recipes' own code, in three wings by reader.

core/        the spine every recipe imports (a copy imports it installed, as accelerate_recipes)
techniques/  one module per technique, imported and copied only by the recipes that show it
tools/       the planner, the copy command, the preflight estimate: never imported by a recipe, never copied
"""
