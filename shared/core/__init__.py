"""The spine: flags, launch, rule table, the task families' common part, the loop's meter, checkpoints, results.
Every recipe imports it (a copy: installed, or with --vendor); it imports nothing from techniques/ or tools/."""
