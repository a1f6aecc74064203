"""Tool calling: parsers of the tool-call formats of the model families we load (``--tool-call-parser``) and the
``tool_choice`` rules (``tool_choice``: none / auto / required / a named function).

``TOOL_PARSERS``: ``hermes`` (Qwen2, Qwen2.5, Qwen3, Hermes), ``llama3_json`` (Llama 3.x), ``mistral``, ``openai``
(gpt-oss's harmony format, read from token ids: ``serving.harmony``).
"""

from serving.tool_parsers.base import ParsedToolCall, ToolCallStream, ToolParser
from serving.tool_parsers.hermes import HermesToolParser
from serving.tool_parsers.llama3_json import Llama3JsonToolParser
from serving.tool_parsers.mistral import MistralToolParser
from serving.tool_parsers.gpt_oss import OpenAIToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {parser.name: parser for parser in
                                             (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                                              OpenAIToolParser)}

__all__ = ["TOOL_PARSERS", "ParsedToolCall", "ToolCallStream", "ToolParser"]
