-- A batch of generated tokens, as push_tokens and complete take it: `count` model tokens
-- (what out_tokens, max_tokens and usage count), `n_ids` uint32 ids a resuming worker
-- primes itself with (one per token by default), and the batch's text.
--!include pool_keys.lua
--!include validate.lua

-- Check the batch's arguments (ARGV values: ids, text, and n_ids, optional); returns n_ids.
local function arg_token_batch(count, token_ids, text, n_ids_arg)
  local n_ids = count
  if n_ids_arg ~= nil and n_ids_arg ~= '' then n_ids = arg_int(n_ids_arg, 'n_ids', 0, 4194304) end
  if token_ids == nil or #token_ids ~= 4 * n_ids then
    fail('BADARG', 'token_ids: expected ' .. (4 * n_ids) .. ' bytes (n_ids x uint32)')
  end
  -- 16 MiB: a completion's echo with logprobs carries its prompt's tokens' in one batch
  if text == nil or #text > 16777216 then fail('BADARG', 'text: missing or over 16 MiB') end
  return n_ids
end

-- Keep the batch's ids with the request, so a worker that takes it over resumes the stream.
local function append_token_ids(id, token_ids, n_ids)
  if n_ids > 0 then redis.call('APPEND', P_TOKENS .. id, token_ids) end
end
