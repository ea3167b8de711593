"""A host application that uses sqla_delayedq from its installed wheel."""
