"""The registry: every family forge imports and exports, one ``FamilySpec`` module each. An
export is the first family whose ``exports`` rule holds for the model; an import the one
whose ``model_type`` ``config.json`` names. A new family is a module here and an entry in
``FAMILIES`` (docs/interop.md, "Adding a model family")."""

from forge.interop.families.deepseek_v3 import DEEPSEEK_V3
from forge.interop.families.llama import LLAMA
from forge.interop.families.mixtral import MIXTRAL
from forge.interop.families.qwen3 import QWEN3
from forge.interop.families.qwen3_moe import QWEN3_MOE

# DeepSeek-V3 first: its rule (latent attention) picks models the others' rules would too,
# and refuse
FAMILIES = (DEEPSEEK_V3, LLAMA, MIXTRAL, QWEN3, QWEN3_MOE)

__all__ = ["DEEPSEEK_V3", "FAMILIES", "LLAMA", "MIXTRAL", "QWEN3", "QWEN3_MOE"]
