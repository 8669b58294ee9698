"""CUDA plumbing, leaf code: side streams (`side_stream`), CUDA-graph capture and buckets
(`graph_capture`), programmatic dependent launch (`pdl`). No model, cache or kernel knowledge."""
