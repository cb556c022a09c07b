"""Accelerate's `HfDeepSpeedConfig`: a DeepSpeed JSON config that can be asked for its ZeRO stage and offload. It
holds no engine: transformers imports it (its DeepSpeed integration, when the deepspeed package is installed) and
its `from_pretrained` asks it whether ZeRO-3 is on. accel reads the same JSON itself (accel/config/plugins.py)."""

from __future__ import annotations

import base64
import copy
import json
import os
from typing import Any


class HfDeepSpeedConfig:
    """`config_file_or_dict`: a dict (copied), a path to a JSON file, a JSON string or its urlsafe base64."""

    def __init__(self, config_file_or_dict: Any) -> None:
        if isinstance(config_file_or_dict, dict):
            config = copy.deepcopy(config_file_or_dict)
        elif isinstance(config_file_or_dict, (str, os.PathLike)) and os.path.exists(config_file_or_dict):
            with open(config_file_or_dict, encoding="utf-8") as f:
                config = json.load(f)
        else:
            config = self._parse(config_file_or_dict)
        self.config = config
        self.set_stage_and_offload()

    @staticmethod
    def _parse(text: Any) -> dict:
        try:
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                return json.loads(base64.urlsafe_b64decode(text).decode("utf-8"))
        except (UnicodeDecodeError, AttributeError, ValueError, TypeError):
            raise ValueError("Expected a string path to an existing deepspeed config, or a dictionary, or a base64 "
                             f"encoded string. Received: {text}") from None

    def set_stage_and_offload(self) -> None:
        self._stage = self.get_value("zero_optimization.stage", -1)
        devices = {self.get_value("zero_optimization.offload_optimizer.device"),
                   self.get_value("zero_optimization.offload_param.device")}
        self._offload = (self.is_zero2() or self.is_zero3()) and bool(devices & {"cpu", "nvme"})

    def find_config_node(self, ds_key_long: str):
        """(the dict holding the last key, the last key); (None, key) where a parent is missing."""
        config: Any = self.config
        *nodes, key = ds_key_long.split(".")
        for node in nodes:
            config = config.get(node)
            if config is None:
                return None, key
        return config, key

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        config, key = self.find_config_node(ds_key_long)
        return default if config is None else config.get(key, default)

    def del_config_sub_tree(self, ds_key_long: str, must_exist: bool = False) -> None:
        config: Any = self.config
        parent: Any = None
        node = None
        for node in ds_key_long.split("."):
            parent, config = config, config.get(node)
            if config is None:
                if must_exist:
                    raise ValueError(f"Can't find {ds_key_long} entry in the config: {self.config}")
                return
        if parent is not None:
            parent.pop(node)

    def is_true(self, ds_key_long: str) -> bool:
        value = self.get_value(ds_key_long)
        return False if value is None else bool(value)

    def is_false(self, ds_key_long: str) -> bool:
        value = self.get_value(ds_key_long)
        return False if value is None else not bool(value)

    def is_zero2(self) -> bool:
        return self._stage == 2

    def is_zero3(self) -> bool:
        return self._stage == 3

    def is_offload(self) -> bool:
        return self._offload
