"""One module per technique, imported (and copied) only by the recipes that show it. Imports core/, never tools/."""
