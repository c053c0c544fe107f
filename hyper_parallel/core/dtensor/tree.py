"""Flatten nested args (tuples, lists, dicts) to leaves and back."""


def tree_flatten(obj):
    leaves = []

    def walk(node):
        if isinstance(node, (list, tuple)):
            return (type(node), [walk(x) for x in node])
        if isinstance(node, dict):
            return (dict, [(k, walk(v)) for k, v in node.items()])
        leaves.append(node)
        return None
    return leaves, walk(obj)


def tree_unflatten(leaves, structure):
    it = iter(leaves)

    def build(node):
        if node is None:
            return next(it)
        kind, children = node
        if kind is dict:
            return {k: build(v) for k, v in children}
        items = [build(c) for c in children]
        if kind in (list, tuple):
            return kind(items)
        return kind(*items) if hasattr(kind, "_fields") else kind(items)
    return build(structure)
