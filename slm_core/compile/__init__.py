"""Build time: checkpoint import, the model, the request graphs, export, checks, packages. A worker never imports it."""
