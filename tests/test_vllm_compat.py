"""asyncllm.vllm: vLLM's Python API over asyncllm, on the tiny random-weight checkpoint (CPU).

The first tests are snippets of vLLM's own docs and examples (examples/offline_inference/basic/basic.py,
basic/chat.py, async_llm_streaming.py, and the abort pattern of tests/v1/engine/test_async_llm.py),
unchanged apart from the import, the model and a few asserts; the rest pin what the layer promises:
vLLM's objects, defaults and output kinds, on top of the native API's own results.
"""
from __future__ import annotations

import asyncio

import anyio
import pytest

from asyncllm import LLM as NativeLLM
from asyncllm import SamplingParams as NativeSamplingParams
from asyncllm.vllm import (LLM, AsyncEngineArgs, AsyncLLM, CompletionOutput, EmbeddingRequestOutput,
                           GuidedDecodingParams, PoolingParams, RequestOutput, RequestOutputKind, SamplingParams,
                           StructuredOutputsParams)
from helpers import assert_all_blocks_free

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

# vLLM's names: block_size is asyncllm's kvcache_block_size; num_kvcache_blocks is asyncllm's own
ENGINE_ARGS = dict(num_kvcache_blocks=256, block_size=16)
NATIVE_KW = dict(num_kvcache_blocks=256, kvcache_block_size=16)
TIMEOUT = 120


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    with LLM(model=tiny_qwen3, **ENGINE_ARGS) as llm:
        yield llm


@pytest.fixture(scope="module")
def async_llm(tiny_qwen3):
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=tiny_qwen3, **ENGINE_ARGS))
    yield engine
    engine.shutdown()


# ---- vLLM's examples, ported ---------------------------------------------------------------------
def test_example_offline_inference_basic(tiny_qwen3):
    # Sample prompts.
    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]
    # Create a sampling params object.
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

    # Create an LLM.
    llm = LLM(model=tiny_qwen3, **ENGINE_ARGS)
    # Generate texts from the prompts. The output is a list of RequestOutput objects
    # that contain the prompt, generated text, and other information.
    outputs = llm.generate(prompts, sampling_params)
    # Print the outputs.
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")

    assert [o.prompt for o in outputs] == prompts
    assert all(isinstance(o, RequestOutput) and o.finished and len(o.outputs) == 1 for o in outputs)
    assert all(1 <= len(o.outputs[0].token_ids) <= 16 for o in outputs)  # vLLM's default max_tokens
    assert len({o.request_id for o in outputs}) == 4
    llm.close()


def test_example_offline_inference_embed(tiny_qwen3):
    # examples/offline_inference/basic/embed.py
    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]
    # Create an LLM.
    llm = LLM(model=tiny_qwen3, task="embed", enforce_eager=True, **ENGINE_ARGS)
    # Generate embedding. The output is a list of EmbeddingRequestOutputs.
    outputs = llm.embed(prompts)
    # Print the outputs.
    print("\nGenerated Outputs:\n" + "-" * 60)
    for prompt, output in zip(prompts, outputs):
        embeds = output.outputs.embedding
        embeds_trimmed = ((str(embeds[:16])[:-1] + ", ...]") if len(embeds) > 16 else embeds)
        print(f"Prompt: {prompt!r} \nEmbeddings: {embeds_trimmed} (size={len(embeds)})")
        print("-" * 60)
    assert all(isinstance(o, EmbeddingRequestOutput) and o.finished for o in outputs)
    # the native LLM's vectors, each prompt's own token ids
    native = NativeLLM(tiny_qwen3, **NATIVE_KW)
    assert [o.prompt_token_ids for o in outputs] == [native.core.encode_prompt(p) for p in prompts]
    for output, vector in zip(outputs, native.embed(prompts)):
        assert output.outputs.hidden_size == 128
        assert output.outputs.embedding == pytest.approx(vector, rel=1e-5, abs=1e-6)
    short = llm.embed({"prompt_token_ids": [5, 6, 7, 8]}, pooling_params=PoolingParams(dimensions=16),
                      truncate_prompt_tokens=3)
    assert short[0].prompt_token_ids == [6, 7, 8] and short[0].outputs.hidden_size == 16
    assert short[0].outputs.embedding == pytest.approx(native.embed([[6, 7, 8]], dimensions=16)[0], rel=1e-5, abs=1e-6)
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed("Hi", pooling_params=PoolingParams(dimensions=0))
    assert_all_blocks_free(llm.native_llm)


def test_example_offline_inference_chat(llm):
    sampling_params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.95, top_k=20)

    def print_outputs(outputs):
        for output in outputs:
            prompt = output.prompt
            generated_text = output.outputs[0].text
            print(f"Prompt: {prompt!r}")
            print(f"Generated text: {generated_text!r}")
        print("-" * 80)

    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
    print_outputs(outputs)
    assert len(outputs) == 1 and outputs[0].prompt.endswith("<|im_start|>assistant\n")
    assert "higher education" in outputs[0].prompt

    # You can run batch inference with llm.chat API
    conversations = [conversation for _ in range(3)]
    outputs = llm.chat(conversations, sampling_params, use_tqdm=True)
    print_outputs(outputs)
    assert len(outputs) == 3 and len({o.prompt for o in outputs}) == 1

    # A chat template can be optionally supplied.
    chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    outputs = llm.chat(conversations, sampling_params, use_tqdm=False, chat_template=chat_template)
    assert outputs[0].prompt.startswith("[system] You are a helpful assistant\n")


async def stream_response(engine: AsyncLLM, prompt: str, request_id: str) -> str:
    print(f"\n🚀 Prompt: {prompt!r}")
    print("💬 Response: ", end="", flush=True)

    # Configure sampling parameters for streaming
    sampling_params = SamplingParams(
        max_tokens=100,
        temperature=0.8,
        top_p=0.95,
        seed=42,  # For reproducible results
        output_kind=RequestOutputKind.DELTA,  # Get only new tokens each iteration
    )
    streamed = ""
    try:
        # Stream tokens from AsyncLLM
        async for output in engine.generate(
            request_id=request_id, prompt=prompt, sampling_params=sampling_params
        ):
            # Process each completion in the output
            for completion in output.outputs:
                # In DELTA mode, we get only new tokens generated since last iteration
                new_text = completion.text
                if new_text:
                    print(new_text, end="", flush=True)
                    streamed += new_text

            # Check if generation is finished
            if output.finished:
                print("\n✅ Generation complete!")
                break

    except Exception as e:
        print(f"\n❌ Error during streaming: {e}")
        raise
    return streamed


async def test_example_async_llm_streaming(tiny_qwen3):
    with anyio.fail_after(TIMEOUT):
        # Create AsyncLLM engine with simple configuration (inside the event loop, as the example)
        engine_args = AsyncEngineArgs(
            model=tiny_qwen3,
            enforce_eager=True,  # Faster startup for examples
            **ENGINE_ARGS,
        )
        engine = AsyncLLM.from_engine_args(engine_args)
        try:
            prompts = [
                "The future of artificial intelligence is",
                "In a galaxy far, far away",
            ]
            for i, prompt in enumerate(prompts, 1):
                request_id = f"stream-example-{i}"
                streamed = await stream_response(engine, prompt, request_id)
                # the deltas make up what the same seeded request gives at once
                final = [o async for o in engine.generate(prompt, SamplingParams(
                    max_tokens=100, temperature=0.8, top_p=0.95, seed=42,
                    output_kind=RequestOutputKind.FINAL_ONLY), f"final-{i}")]
                assert len(final) == 1 and final[0].outputs[0].text == streamed
                if i < len(prompts):
                    await asyncio.sleep(0.01)
        finally:
            # Always clean up the engine
            engine.shutdown()
        assert engine.errored


@pytest.mark.parametrize("output_kind", [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
async def test_example_abort_gives_a_final_output(async_llm, output_kind):
    with anyio.fail_after(TIMEOUT):
        engine = async_llm
        request_id = "test-abort-final-output"
        sampling_params = SamplingParams(
            max_tokens=3000,  # Long enough to allow abort
            ignore_eos=True,
            output_kind=output_kind,
            temperature=0.5,
            seed=42,
        )
        outputs: list[RequestOutput] = []
        started = asyncio.Event()

        async def collect_outputs():
            async for output in engine.generate(request_id=request_id, prompt="Hello my name is Robert and",
                                                sampling_params=sampling_params):
                outputs.append(output)
                started.set()

        generated = asyncio.create_task(collect_outputs())
        if output_kind is RequestOutputKind.DELTA:
            await started.wait()  # it has generated some tokens (vLLM's test sleeps 0.5 s instead)
        else:
            await asyncio.sleep(0)  # submitted; FINAL_ONLY shows nothing before the end
        await engine.abort(request_id)
        await generated
        final_output = outputs[-1]
        assert final_output.finished
        assert len(final_output.outputs) == 1
        assert final_output.outputs[0].finish_reason == "abort"
        assert final_output.outputs[0].stop_reason is None
        assert all(not o.finished for o in outputs[:-1])
        await engine.engine.wait_idle()
        stats = engine.engine.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


# ---- what the layer promises ---------------------------------------------------------------------
def test_generate_matches_the_native_llm(llm, tiny_qwen3):
    prompts = ["Hello, my name is", {"prompt": "The capital of France is"}, {"prompt_token_ids": [11, 22, 33, 44]}]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    native = NativeLLM(tiny_qwen3, **NATIVE_KW)
    expected = native.generate(["Hello, my name is", "The capital of France is", [11, 22, 33, 44]],
                               NativeSamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    assert [o.prompt for o in outputs] == ["Hello, my name is", "The capital of France is", None]
    assert outputs[0].prompt_token_ids == tokenizer.encode("Hello, my name is")
    assert outputs[2].prompt_token_ids == [11, 22, 33, 44]
    for output, want in zip(outputs, expected):
        completion = output.outputs[0]
        assert isinstance(completion, CompletionOutput) and completion.finished()
        assert (completion.text, completion.token_ids, completion.finish_reason) == \
            (want["text"], want["token_ids"], "length")
        assert completion.cumulative_logprob is None and completion.logprobs is None
    native.close()
    assert_all_blocks_free(llm.native_llm)


def test_n_logprobs_and_prompt_logprobs_in_vllm_shapes(llm):
    [output] = llm.generate("Hello, my name is", SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=5,
                                                                logprobs=2, prompt_logprobs=1), use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1]
    for completion in output.outputs:
        assert len(completion.logprobs) == len(completion.token_ids)
        for token_id, entry in zip(completion.token_ids, completion.logprobs):
            assert token_id in entry and next(iter(entry)) == token_id  # the sampled token first
            assert 2 <= len(entry) <= 3 and all(lp.rank >= 1 and lp.decoded_token is not None for lp in entry.values())
        assert completion.cumulative_logprob == pytest.approx(
            sum(entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs)))
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(output.prompt_token_ids)
    assert all(output.prompt_token_ids[i] in output.prompt_logprobs[i] for i in range(1, len(output.prompt_token_ids)))


def test_vllm_defaults_and_options(llm):
    params = SamplingParams()
    assert (params.max_tokens, params.top_k, params.stop, params.stop_token_ids) == (16, 0, None, None)
    native = params.to_native()
    assert (native.max_tokens, native.top_k, native.stop, native.stop_token_ids) == (16, -1, [], [])
    # detokenize=False leaves the text out; truncate_prompt_tokens keeps the prompt's last tokens
    [output] = llm.generate({"prompt_token_ids": [11, 22, 33, 44, 55]}, SamplingParams(
        temperature=0, max_tokens=4, detokenize=False, truncate_prompt_tokens=3), use_tqdm=False)
    assert output.prompt_token_ids == [33, 44, 55] and output.outputs[0].text == ""
    assert len(output.outputs[0].token_ids) >= 1
    with pytest.raises(ValueError, match=r"SamplingParams\.stop: stop strings need detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(ValueError, match=r"SamplingParams\.temperature"):
        SamplingParams(temperature=-1)  # checked where the native SamplingParams checks it
    with pytest.raises(ValueError, match=r"SamplingParams\.truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


def test_max_tokens_none_runs_to_the_context(tiny_qwen3):
    with LLM(tiny_qwen3, max_model_len=40, **ENGINE_ARGS) as small:
        [output] = small.generate([11, 22, 33], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True),
                                  use_tqdm=False)
        assert len(output.outputs[0].token_ids) == 40 - 3 and output.outputs[0].finish_reason == "length"
        # and the native API takes vLLM's None defaults too
        [native] = small.native_llm.generate([[11, 22, 33]], NativeSamplingParams(
            max_tokens=None, stop=None, stop_token_ids=None, temperature=0, ignore_eos=True), use_tqdm=False)
        assert native["token_ids"] == output.outputs[0].token_ids


def test_structured_outputs_and_guided_decoding(llm):
    choice = StructuredOutputsParams(choice=["yes", "no"])
    for params in (SamplingParams(structured_outputs=choice, max_tokens=8),
                   SamplingParams(guided_decoding=GuidedDecodingParams(regex="(yes|no)"), max_tokens=8)):
        [output] = llm.generate("Answer:", params, use_tqdm=False)
        assert output.outputs[0].text in ("yes", "no")
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(structured_outputs=choice, guided_decoding=choice)
    with pytest.raises(ValueError, match=r"StructuredOutputsParams\.disable_any_whitespace: not supported"):
        StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True)


def test_engine_args_vllm_names_and_refusals(tiny_qwen3):
    with pytest.raises(ValueError, match=r"trust_remote_code=True: not supported \(asyncllm never runs"):
        LLM(tiny_qwen3, trust_remote_code=True)
    with pytest.raises(ValueError, match=r"Config\.quantization: must be one of \(None, .fp8., .fp8_weight_only.\), got .awq."):
        LLM(tiny_qwen3, quantization="awq")
    with pytest.raises(TypeError, match="no_such_option"):
        LLM(tiny_qwen3, no_such_option=1)
    with pytest.raises(ValueError, match="lora_request"):
        LLM(tiny_qwen3, **ENGINE_ARGS).generate("x", lora_request=object())


async def test_output_kinds_on_one_request(async_llm):
    with anyio.fail_after(TIMEOUT):
        def params(kind):
            return SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, logprobs=1,
                                  output_kind=kind)

        cumulative = [o async for o in async_llm.generate("Hello", params(RequestOutputKind.CUMULATIVE), "c")]
        delta = [o async for o in async_llm.generate("Hello", params(RequestOutputKind.DELTA), "d")]
        [final] = [o async for o in async_llm.generate("Hello", params(RequestOutputKind.FINAL_ONLY), "f")]
        assert [o.finished for o in cumulative] == [False] * (len(cumulative) - 1) + [True]
        assert [o.finished for o in delta] == [False] * (len(delta) - 1) + [True]
        assert final.finished and [c.index for c in final.outputs] == [0, 1]
        for index in (0, 1):
            whole = final.outputs[index]
            ours = [o.outputs[0] for o in cumulative if o.outputs[0].index == index]
            assert all(a.token_ids == b.token_ids[:len(a.token_ids)] for a, b in zip(ours, ours[1:]))  # growing
            assert (ours[-1].text, ours[-1].token_ids, ours[-1].finish_reason) == \
                (whole.text, whole.token_ids, whole.finish_reason)
            assert ours[-1].logprobs == whole.logprobs and ours[-1].cumulative_logprob == pytest.approx(
                whole.cumulative_logprob)
            pieces = [o.outputs[0] for o in delta if o.outputs[0].index == index]
            assert "".join(p.text for p in pieces) == whole.text
            assert [t for p in pieces for t in p.token_ids] == whole.token_ids
        assert {o.request_id for o in cumulative} == {"c"} and final.request_id == "f"
        assert final.prompt == "Hello" and final.prompt_token_ids == async_llm.get_tokenizer().encode("Hello")


async def test_leaving_the_loop_aborts_the_request(async_llm):
    with anyio.fail_after(TIMEOUT):
        outputs = async_llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(
            max_tokens=None, ignore_eos=True, output_kind=RequestOutputKind.DELTA), "left")
        async for output in outputs:
            assert output.prompt is None and not output.finished
            break
        await outputs.aclose()
        await async_llm.engine.wait_idle()
        stats = async_llm.engine.stats()
        assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
        await async_llm.check_health()
        assert not async_llm.errored
