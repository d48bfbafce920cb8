"""The project's errors: what a user gave (flags, configs, data, model, checkpoint) cannot run, said with the fix.

They are ordinary exceptions, so a caller in the same process (a notebook, Ray, a user's own loop) can catch them;
`launch.entrypoint` turns one into the message and exit code a user sees on the command line."""

from __future__ import annotations


class RecipeError(Exception):
    """A refusal: the message names the problem and the fix. Raised before any work is lost where it can be."""


class LaunchError(RecipeError):
    """The launch (config, processes, environment) or the flags cannot train together: the rule table's refusals."""


class InputError(RecipeError):
    """The data, the model or a file the user gave cannot be used as given."""


class CheckpointError(RecipeError):
    """A checkpoint or an output directory cannot be resumed from or written to."""


class TrainingError(RecipeError):
    """The run stopped itself while training (a diverging loss, a fault), its state saved where it could be."""


class RunFinished(Exception):  # noqa: N818 (not an error)
    """Not a refusal: the run asked for is finished already (a resume with nothing to train where results.json is
    written, a torch elastic restart after it was). `launch.entrypoint` returns its `results`, exit code 0."""

    def __init__(self, results: dict) -> None:
        super().__init__("the run is finished")
        self.results = results
