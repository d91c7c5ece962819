"""MLflow search filters on names the user chose (run names, study names), whatever characters they hold.

MLflow's filter parser takes a string between single or double quotes and strips them without unescaping anything:
`'it\\'s'` and `'it''s'` match nothing, and a bare `'` inside single quotes is a syntax error. So a value is quoted
with the quote it does not contain; one that holds both is matched with LIKE, its single quotes as `_` (any one
character), and the caller keeps the exact matches.
"""

from __future__ import annotations


def equals(field: str, value: str) -> str:
    """A filter clause matching `field` == `value`; for a value with both quotes a superset (see the module doc)."""
    value = str(value)
    if "'" not in value:
        return f"{field} = '{value}'"
    if '"' not in value:
        return f'{field} = "{value}"'
    return f"{field} LIKE '{value.replace(chr(39), '_')}'"
