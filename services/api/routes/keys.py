from __future__ import annotations

import dataclasses

from fastapi import APIRouter, HTTPException

from crucible.apikeys import create_key, list_keys, revoke_key
from services.api.auth import ADMIN, WRITE_RESPONSES, KeyDep
from services.api.deps import IdPath, SessionDep
from services.api.schemas import KeyCreate, KeyCreated, KeyOut

router = APIRouter(prefix="/v1/keys", tags=["keys"], dependencies=[ADMIN], responses=WRITE_RESPONSES)


@router.post("", status_code=201)
async def post_key(body: KeyCreate, session: SessionDep) -> KeyCreated:
    """A new API key; its token is in this response only."""
    info, token = await create_key(session, scope=body.scope, name=body.name)
    return KeyCreated(**dataclasses.asdict(info), token=token)


@router.get("")
async def get_keys(session: SessionDep) -> list[KeyOut]:
    """Every key, revoked ones included, oldest first (never their secrets)."""
    return [KeyOut.model_validate(info) for info in await list_keys(session)]


@router.post(
    "/{key_id}/revoke",
    responses={
        404: {"description": "No key with this id."},
        409: {"description": "A key cannot revoke itself."},
    },
)
async def post_revoke(key_id: IdPath, session: SessionDep, caller: KeyDep) -> KeyOut:
    """Revoke a key: from now on it is a 401. Revoking a revoked key changes nothing."""
    if key_id == caller.key_id:
        raise HTTPException(
            status_code=409, detail="a key cannot revoke itself; revoke it with another admin key"
        )
    info = await revoke_key(session, key_id)
    if info is None:
        raise HTTPException(status_code=404, detail=f"no key {key_id}")
    return KeyOut.model_validate(info)
