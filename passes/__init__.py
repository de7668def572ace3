"""Graph passes, one per module (``fusion_prep.py`` holds the four that prepare fusion). Each takes ``(GraphModule, PassContext)`` and returns a
``PassResult``; ``pipeline.py`` runs them in order, lints between them and recompiles after the last."""
from .carry_retention import carry_retention
from .fuse_exact import fuse_exact
from .fusion_prep import cats_in_place, contiguous_norm_inputs, functional_temporaries, split_conv_bias
from .hoist_constants import hoist_constants
from .host_checks import host_checks
from .lower_guarded import lower_guarded
from .mask_writes import mask_writes
from .shape_enumeration import shape_enumeration

__all__ = ["hoist_constants", "host_checks", "carry_retention", "mask_writes",
           "functional_temporaries", "cats_in_place", "split_conv_bias", "contiguous_norm_inputs",
           "fuse_exact", "shape_enumeration", "lower_guarded"]
