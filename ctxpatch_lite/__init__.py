"""ctxpatch_lite: context as weight patches in modern transformer blocks (Goldwaser et al., ICML 2026)."""
from .models import DTYPES, ModelLoadError, describe_model, load_model, resolve_device, resolve_dtype

__version__ = "0.1.0"
__all__ = ["DTYPES", "ModelLoadError", "describe_model", "load_model", "resolve_device", "resolve_dtype"]
