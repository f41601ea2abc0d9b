import json
from pathlib import Path


def test_the_image_has_pyjwt():
    import jwt

    assert jwt.__version__ == "2.8.0"


def test_only_verified_claims_in_order():
    claims = json.loads(Path("/app/claims.json").read_text())
    assert [c["sub"] for c in claims] == ["ada", "cy", "eve"]
    assert claims[0] == {"sub": "ada", "role": "admin", "iat": 1700000000}
