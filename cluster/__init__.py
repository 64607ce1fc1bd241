"""Running dpfl on a Ray cluster: ``dpfl submit`` (:mod:`engine.cli.submit`); the cluster
definitions (KubeRay, ``ray up``) live beside this package."""
