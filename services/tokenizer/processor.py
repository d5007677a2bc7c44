"""One request in, one message out: the tokenizer service's work without its sockets.

`Processor.process` turns a GenerateRequest into exactly one of:
- a TokenizedRequest (validated; the service PUSHes it to admit),
- a TokenizeResult (mode="tokenize": the ids and offsets, published to out.<ingress>; nothing is generated),
- a RequestError (published to out.<ingress>; it ends the request).

Structured output is checked here (services.tokenizer.grammar): tools are selected by tool_choice before the
chat template renders (TGI raises its tool errors first), and the grammar is compiled against the served
vocabulary after the length checks (TGI's order); only its text travels on.
"""

from __future__ import annotations

import os

import numpy as np
from tokenizers import Tokenizer

from libs.protocol.lora import KnownAdapters
from libs.protocol.messages import GenerateRequest, RequestError, TokenizedRequest, TokenizeResult, pixel_frames
from libs.runtime import metrics, model_store
from libs.runtime.settings import Settings
from services.http import reasoning
from services.http.tool_parsers import ToolParser, native_parser
from services.tokenizer import validation
from services.tokenizer.answer_grammar import answer_schema, compiled, json_answer_lark, reasoning_lark, tool_plan
from services.tokenizer.chat_template import ChatTemplates, TemplateError
from services.tokenizer.grammar import Checked, GrammarCompiler, GrammarLimits, ToolError, ToolPlan, tool_grammar
from services.tokenizer.images.decode import ImageError
from services.tokenizer.images.processor import ImageProcessor, Images, has_image_parts, template_image_urls

Result = TokenizedRequest | TokenizeResult | RequestError


class Processor:
    def __init__(self, settings: Settings, tokenizer: Tokenizer, templates: ChatTemplates) -> None:
        self.settings = settings
        self.adapters = KnownAdapters()  # the schedulers' announcements replace the start-up list of LoRA adapters
        self.tokenizer = tokenizer
        self.templates = templates
        self.reasoning = reasoning.choose(templates.source(tools=False), settings.reasoning_parser)
        self.limits = GrammarLimits(
            max_bytes=settings.grammar_max_bytes,
            max_depth=settings.grammar_max_depth,
            compile_timeout_s=settings.grammar_compile_timeout_s,
        )
        self.eos_ids = eos_ids(settings.model_path, tokenizer, templates)
        self.vocab_size = vocab_size(settings.model_path, tokenizer)  # logit_bias / stop_token_ids are checked by it
        self.images = ImageProcessor.for_model(settings)  # None: a text-only model
        # the LLTokenizer is built on a thread (Gemma's vocabulary: seconds); the first grammar waits for it
        self.grammars = GrammarCompiler(
            os.path.join(settings.model_path, "tokenizer.json"),
            self.eos_ids,
            limits=self.limits,
            disabled=settings.disable_grammar_support,
        )

    @classmethod
    def from_settings(cls, settings: Settings) -> Processor:
        tokenizer = Tokenizer.from_file(os.path.join(settings.model_path, "tokenizer.json"))
        return cls(settings, tokenizer, ChatTemplates.load(settings.model_path, settings.chat_template))

    def close(self) -> None:
        self.grammars.close()

    def process(self, req: GenerateRequest) -> Result:
        try:
            if req.mode == "tokenize":
                return self._tokenize(req)
            if req.mode == "detokenize":
                return self._detokenize(req)
            return self._generate(req)
        except (validation.ValidationError, TemplateError) as e:
            return RequestError(request_id=req.request_id, message=e.full_message, error_type=e.error_type)

    def _native(self, req: GenerateRequest) -> ToolParser | None:
        """The model's own tool-call format for this request, or None: TGI's way (tool_parsers.native_parser)."""
        t = self.templates
        return native_parser(t.source(), t.uses_tools(), self.settings.tool_call_parser, req.tool_prompt)

    def _tools(self, req: GenerateRequest) -> ToolPlan:
        """Tool selection (raises its ToolErrors before anything is validated): in the model's own format
        (services.tokenizer.answer_grammar) or TGI's."""
        has_grammar = req.parameters.grammar is not None
        parser = self._native(req) if req.messages is not None else None
        if parser is not None:
            specials = {t.content: i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}
            plan = tool_plan(
                parser,
                req.tools,
                req.tool_choice,
                parallel=req.parallel_tool_calls,
                specials=specials,
                has_grammar=has_grammar,
                limits=self.limits,
            )
            if plan.lark is None:
                return plan._replace(kind="native")
            try:
                return plan._replace(text=compiled(plan.lark))
            except Exception as e:  # a schema llguidance cannot read
                raise ToolError(f"the tools' schemas are not valid: {e}") from None
        return tool_grammar(req.tools, req.tool_choice, has_grammar=has_grammar, limits=self.limits)

    def _prompt(self, req: GenerateRequest, plan: ToolPlan) -> tuple[str, bool]:
        """The text to tokenize and whether to add special tokens. A chat request's text is its rendered template,
        tokenized without special tokens (the template holds them, as in TGI)."""
        if req.messages is None:
            return req.inputs, req.add_special_tokens
        messages = req.messages
        # a vision model's own multimodal template writes its image token for each image part (flattened, the
        # parts would reach it as one string it cannot loop over)
        images_native = self.images is not None and has_image_parts(messages) and self.templates.reads_parts(plan.tools)
        if plan.lark is not None or plan.kind == "native" or images_native:
            return self.templates.render(
                messages, plan.tools, req.chat_template_kwargs, req.documents, native=True
            ), False
        if plan.tools is not None:
            messages = self.templates.with_tool_prompt(messages, plan.tools, req.tool_prompt)
        return self.templates.render(messages, plan.tools, req.chat_template_kwargs, req.documents), False

    def _encode(self, text: str, add_special_tokens: bool):
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as e:  # TGI's ValidationError::Tokenizer
            raise validation.ValidationError(f"tokenizer error {e}") from e

    def _tokenize(self, req: GenerateRequest) -> TokenizeResult:
        """TGI's /tokenize and /chat_tokenize: no parameter validation, no truncation. A vision model's images
        become their placeholder tokens as they do for generation (the tokens a prefill feeds); the text is the
        prompt with the model's image token where each image was, and each of an image's tokens has that token's
        offsets."""
        text, special = self._prompt(req, self._tools(req))
        text, images = self._image_placeholders(req, text, observe=False)
        encoding = self._encode(text, special)
        ids = encoding.ids
        offsets = np.asarray(encoding.offsets, dtype=np.uint32).reshape(-1, 2)
        if images is not None:
            ids, offsets = self._expand_offsets(ids, offsets, images)
        return TokenizeResult(
            request_id=req.request_id,
            text=text,
            ids=np.asarray(ids, dtype=np.int32),
            starts=np.ascontiguousarray(offsets[:, 0]),
            stops=np.ascontiguousarray(offsets[:, 1]),
        )

    def _expand_offsets(self, ids: list[int], offsets: np.ndarray, images: Images) -> tuple[list[int], np.ndarray]:
        """The ids with each image token expanded (as for generation), and the offsets repeated to match."""
        try:
            expanded, _ = self.images.expand(ids, images)
        except ImageError as e:
            raise validation.ValidationError(str(e)) from None
        repeats = np.ones(len(ids), dtype=np.int64)
        repeats[np.asarray(ids) == self.images.image_token_id] = [len(t) for t in images.token_ids]
        return expanded, np.repeat(offsets, repeats, axis=0)

    def _detokenize(self, req: GenerateRequest) -> TokenizeResult:
        """vLLM's /detokenize: the text of `prompt_ids` (special tokens included, as vLLM decodes them)."""
        ids = self._prompt_ids(req.prompt_ids) if req.prompt_ids else []
        none = np.zeros(len(ids), dtype=np.uint32)  # no offsets: the text is the tokens'
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        return TokenizeResult(
            request_id=req.request_id, text=text, ids=np.asarray(ids, dtype=np.int32), starts=none, stops=none
        )

    def _generate(self, req: GenerateRequest) -> TokenizedRequest:
        s, p = self.settings, req.parameters
        # TGI applies the chat template before it validates anything (try_into_generate), so a template error
        # wins over every validation error of the same request.
        plan = self._tools(req)
        text, special = self._prompt(req, plan) if req.prompt_ids is None else ("", False)
        validation.check_parameters(
            p,
            inputs=text if req.prompt_ids is None else "ids",  # ids: their emptiness is checked by _prompt_ids
            max_stop_sequences=s.max_stop_sequences,
            max_input_tokens=s.max_input_tokens,
            max_best_of=s.max_best_of,
            max_top_n_tokens=s.max_top_n_tokens,
            stream=req.stream,
        )
        validation.check_openai_parameters(p, vocab_size=self.vocab_size)
        validation.check_priority(p, s.scheduling_policy)
        adapter = validation.check_adapter(p.adapter_id, self.adapters.names(s.lora_names), s.model_id)
        text, images = self._image_placeholders(req, text)
        ids = self._encode(text, special).ids if req.prompt_ids is None else self._prompt_ids(req.prompt_ids)
        placed = []
        if images is not None:  # each image token becomes its image's placeholder tokens: they count as prompt tokens
            try:
                ids, placed = self.images.expand(ids, images)
            except ImageError as e:
                raise validation.ValidationError(str(e)) from None
        resolved = validation.resolve(
            p,
            ids,
            max_input_tokens=s.max_input_tokens,
            max_total_tokens=s.max_total_tokens,
            eos_ids=self.eos_ids,
        )
        # TGI checks the grammar last; a thinking budget's grammar holds the answer's (tools) behind the reasoning
        checked = self._budget(req, text, plan) or self._grammar(p.grammar, plan)
        return TokenizedRequest(
            request_id=req.request_id,
            ingress=req.ingress,
            input_ids=np.asarray(resolved.input_ids, dtype=np.int32),
            sampling=resolved.sampling,
            max_new_tokens=resolved.max_new_tokens,
            stop=p.stop,
            seed=resolved.seed,
            received_at=req.received_at,
            traceparent=req.traceparent,
            grammar=checked.grammar.text if checked else "",
            grammar_kind=checked.kind if checked else "",
            adapter=adapter,
            group=req.group,
            **_image_fields(placed, images, len(ids) - len(resolved.input_ids)),
        )

    def _image_placeholders(self, req: GenerateRequest, text: str, observe: bool = True) -> tuple[str, Images | None]:
        """The prompt with its markdown images as the model's image token, and the images processed (None: none).
        A text-only model answers a markdown image as text (TGI) but refuses an OpenAI image part. `observe`: count
        the request's images in the metrics (a generation, not a /tokenize)."""
        if self.images is None:
            if req.messages is not None and has_image_parts(req.messages):
                raise validation.ValidationError("this model does not take images (it is a text-only model)")
            return text, None
        try:
            text, urls = self.images.placeholders(text, template_image_urls(req.messages, text))
            images = self.images.process(urls) if urls else None
        except ImageError as e:
            raise validation.ValidationError(str(e)) from None
        m = metrics.get() if observe else None
        if m is not None:
            m.request_images.observe(len(urls))
            if images is not None:
                m.image_preprocess_duration.observe(images.seconds)
        return text, images

    def _prompt_ids(self, ids: list[int]) -> list[int]:
        """A prompt given as token ids, used without re-tokenizing: each must be in the vocabulary."""
        if not ids:
            raise validation.ValidationError("`inputs` cannot be empty")
        vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise validation.ValidationError(
                f"token id {bad[0]} in `prompt` is out of the vocabulary (ids must be >= 0 and < {vocab})"
            )
        return list(ids)

    def _budget(self, req: GenerateRequest, text: str, plan: ToolPlan) -> Checked | None:
        """Where the rendered prompt leaves reasoning open: a thinking budget's grammar, or a JSON response_format's
        that constrains only the answer after the reasoning (bounded by the budget if one is given). A regex or
        Lark grammar still constrains the whole output."""
        if req.messages is None or self.reasoning is None:
            return None
        grammar = req.parameters.grammar
        schema = None if grammar is None or self.grammars.disabled else answer_schema(grammar, self.grammars.limits)
        if (req.thinking_budget is None and schema is None) or (grammar is not None and schema is None):
            return None
        if not self.reasoning.opened_in(text):
            return None
        answer = plan.lark if schema is None else json_answer_lark(schema)
        calls = schema is None and plan.lark is not None
        lark = reasoning_lark(self.reasoning, self.tokenizer, req.thinking_budget, answer, calls)
        return self.grammars.compile("reasoning", compiled(lark))

    def _grammar(self, grammar, plan: ToolPlan) -> Checked | None:
        """The request's grammar, checked and compiled (ValidationError / ToolError with TGI's messages)."""
        checked = self.grammars.check_tools(plan) if plan.text is not None else self.grammars.check(grammar)
        m = metrics.get()
        if checked is not None and m is not None:
            m.grammar_compile_duration.labels(kind=checked.kind).observe(checked.compile_s)
        return checked


def _image_fields(placed: list, images: Images | None, cut: int) -> dict:
    """The TokenizedRequest's images and pixels, placed in the prompt after `cut` ids were truncated from its left
    (a truncation that cuts into an image is refused)."""
    if not placed:
        return {}
    if placed[0].start < cut:
        raise validation.ValidationError("`truncate` would cut an image's tokens out of the prompt")
    for im in placed:
        im.start -= cut
    return {"images": placed, **pixel_frames([p.ravel() for p in images.pixels])}


def eos_ids(model_path: str, tokenizer: Tokenizer, templates: ChatTemplates) -> list[int]:
    """Every EOS id of the model (generation_config / config), or the tokenizer's eos token: a grammar may end on
    any of them."""
    try:
        ids = [int(i) for i in model_store.model_info(model_path)["eos_token_ids"]]
    except model_store.ModelNotAvailableError:
        ids = []
    if not ids and templates.eos_token is not None:
        token = tokenizer.token_to_id(templates.eos_token)
        ids = [] if token is None else [token]
    return ids


def vocab_size(model_path: str, tokenizer: Tokenizer) -> int:
    """The token ids a request may name (logit_bias, stop_token_ids): the tokenizer's, within the model's LM head
    where its config is known."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    try:
        head = model_store.model_info(model_path).get("vocab_size")
    except model_store.ModelNotAvailableError:
        head = None
    return min(size, int(head)) if head else size
