"""The spine: flags, launch, rule table, the three task families, the loop's meter, checkpoints, results. Every
recipe imports it and every copy carries it; it imports nothing from techniques/ or tools/."""
