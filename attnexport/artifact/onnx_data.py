"""The external data an ``.onnx`` file names stays in its directory; no torch.

onnxruntime >= 1.24 refuses external data outside the model's directory itself (an absolute
``location``, ``..``, a link out of it). Older releases, the newest there is for Python 3.10,
read whatever ``location`` names, so for them the model is checked here before it is loaded.
"""

from __future__ import annotations

from pathlib import Path

from attnexport.artifact.errors import ArtifactError
from attnexport.contained_files import contained_file

ORT_CHECKS_EXTERNAL_DATA = (1, 24)
"""The first onnxruntime release that validates external data paths itself."""


def ort_checks_external_data() -> bool:
    """Whether the installed onnxruntime refuses external data outside a model's directory."""
    import onnxruntime

    release = tuple(int(p) for p in onnxruntime.__version__.split(".")[:2] if p.isdigit())
    return release >= ORT_CHECKS_EXTERNAL_DATA


def check_external_data(path: Path) -> None:
    """Every external data ``location`` of the ONNX file ``path`` is a regular file of its
    directory (:func:`attnexport.contained_files.contained_file`).

    Raises:
        UnsafePathError: a location that is absolute, has ``..``, or is a link.
        ArtifactError: a location that names no file, or a file that is not ONNX.
    """
    import onnx
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load(str(path), load_external_data=False)
    except DecodeError as error:
        raise ArtifactError(f"{path}: not a valid ONNX model ({error}); re-export it") from None
    graphs = [model.graph, *model.functions]
    while graphs:
        graph = graphs.pop()
        tensors = [*getattr(graph, "initializer", ())]
        for sparse in getattr(graph, "sparse_initializer", ()):
            tensors += [sparse.values, sparse.indices]
        for node in graph.node:
            for attribute in node.attribute:
                tensors += [attribute.t, *attribute.tensors]
                graphs += [attribute.g, *attribute.graphs]
        for tensor in tensors:
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue
            location = {e.key: e.value for e in tensor.external_data}.get("location", "")
            file = contained_file(path.parent, location)
            if not file.is_file():
                raise ArtifactError(
                    f"{path}: tensor {tensor.name!r}: its external data {location!r} is not a "
                    f"file of {path.parent}; re-export the model"
                )
