/* chat.c — see chat.h. Renders into a growing buffer. */
#include "engine/chat.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "engine/tokenizer.h"

const char *eng_chat_kind_name(eng_chat_kind_t k)
{
    static const char *const n[] = {"chatml", "llama3", "llama2", "mistral"};
    return n[k];
}

/* The default system prompt a ChatML template hard-codes, if any:
 * the text between "<|im_start|>system" + newline and "<|im_end|>" inside a
 * string literal of the template ("\n" escapes are undone). */
static char *chatml_default_system(const char *tmpl)
{
    const char *p = strstr(tmpl, "<|im_start|>system");
    while (p) {
        const char *q = p + strlen("<|im_start|>system");
        size_t skip = q[0] == '\n' ? 1 : (q[0] == '\\' && q[1] == 'n') ? 2 : 0;
        const char *end = skip ? strstr(q + skip, "<|im_end|>") : NULL;
        /* a literal, not a "+ message['content'] +" expression */
        if (end && !memchr(q + skip, '\'', (size_t)(end - q - skip)) && !memchr(q + skip, '{', (size_t)(end - q - skip))) {
            size_t n = (size_t)(end - q - skip);
            char *s = malloc(n + 1), *o = s;
            if (!s)
                return NULL;
            for (const char *c = q + skip; c < end; c++) {
                if (c[0] == '\\' && c + 1 < end && c[1] == 'n') {
                    *o++ = '\n';
                    c++;
                } else {
                    *o++ = *c;
                }
            }
            *o = '\0';
            return s;
        }
        p = strstr(q, "<|im_start|>system");
    }
    return NULL;
}

td_status_t eng_chat_init(eng_chat_t *chat, const eng_tokenizer_t *tok)
{
    memset(chat, 0, sizeof *chat);
    const char *t = eng_tokenizer_chat_template(tok);
    if (!t || !t[0])
        return td_error(TD_ERR_NOT_FOUND, "chat: the model ships no chat template");
    size_t n;
    const char *s;
    if ((s = eng_tokenizer_token_text(tok, eng_tokenizer_bos(tok), &n)) && n < sizeof chat->bos)
        memcpy(chat->bos, s, n);
    if ((s = eng_tokenizer_token_text(tok, eng_tokenizer_eos(tok), &n)) && n < sizeof chat->eos)
        memcpy(chat->eos, s, n);
    if (strstr(t, "<|im_start|>")) {
        chat->kind = ENG_CHAT_CHATML;
        chat->default_system = chatml_default_system(t);
    } else if (strstr(t, "<|start_header_id|>")) {
        chat->kind = ENG_CHAT_LLAMA3;
    } else if (strstr(t, "[INST]")) {
        chat->kind = strstr(t, "<<SYS>>") ? ENG_CHAT_LLAMA2 : ENG_CHAT_MISTRAL;
    } else {
        return td_error(TD_ERR_UNSUPPORTED, "chat: the model's chat template is of no family tandem renders "
                        "(ChatML, Llama 3, Llama 2, Mistral)");
    }
    return TD_OK;
}

void eng_chat_free(eng_chat_t *chat)
{
    free(chat->default_system);
    chat->default_system = NULL;
}

typedef struct sbuf {
    char *s;
    size_t n, cap;
    bool oom;
} sbuf_t;

static void sb_add(sbuf_t *b, const char *s, size_t n)
{
    if (b->oom)
        return;
    if (b->n + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 256;
        while (nc < b->n + n + 1)
            nc *= 2;
        char *ns = realloc(b->s, nc);
        if (!ns) {
            b->oom = true;
            return;
        }
        b->s = ns;
        b->cap = nc;
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = '\0';
}

static void sb_str(sbuf_t *b, const char *s) { sb_add(b, s, strlen(s)); }

/* Jinja's |trim: strips leading and trailing whitespace. */
static void sb_trimmed(sbuf_t *b, const char *s)
{
    const char *e = s + strlen(s);
    while (*s == ' ' || (*s >= '\t' && *s <= '\r'))
        s++;
    while (e > s && (e[-1] == ' ' || (e[-1] >= '\t' && e[-1] <= '\r')))
        e--;
    sb_add(b, s, (size_t)(e - s));
}

static bool role_ok(const char *r)
{
    return r && (!strcmp(r, "system") || !strcmp(r, "user") || !strcmp(r, "assistant"));
}

td_status_t eng_chat_render(const eng_chat_t *chat, const eng_chat_msg_t *msgs, size_t n,
                            bool add_generation_prompt, char **out)
{
    for (size_t i = 0; i < n; i++) {
        if (!role_ok(msgs[i].role))
            return td_error(TD_ERR_INVALID_ARG, "chat: messages[%zu].role '%s' is not system, user or assistant", i,
                            msgs[i].role ? msgs[i].role : "(null)");
        if (!msgs[i].content)
            return td_error(TD_ERR_INVALID_ARG, "chat: messages[%zu].content is missing", i);
        if (!strcmp(msgs[i].role, "system") && i > 0 && chat->kind != ENG_CHAT_CHATML)
            return td_error(TD_ERR_INVALID_ARG, "chat: messages[%zu] is a system turn; %s allows one, first", i,
                            eng_chat_kind_name(chat->kind));
    }
    sbuf_t b = {0};
    sb_add(&b, "", 0);
    switch (chat->kind) {
    case ENG_CHAT_CHATML:
        if (chat->default_system && (n == 0 || strcmp(msgs[0].role, "system"))) {
            sb_str(&b, "<|im_start|>system\n");
            sb_str(&b, chat->default_system);
            sb_str(&b, "<|im_end|>\n");
        }
        for (size_t i = 0; i < n; i++) {
            sb_str(&b, "<|im_start|>");
            sb_str(&b, msgs[i].role);
            sb_str(&b, "\n");
            sb_str(&b, msgs[i].content);
            sb_str(&b, "<|im_end|>\n");
        }
        if (add_generation_prompt)
            sb_str(&b, "<|im_start|>assistant\n");
        break;
    case ENG_CHAT_LLAMA3:
        if (n)
            sb_str(&b, chat->bos);
        for (size_t i = 0; i < n; i++) {
            sb_str(&b, "<|start_header_id|>");
            sb_str(&b, msgs[i].role);
            sb_str(&b, "<|end_header_id|>\n\n");
            sb_trimmed(&b, msgs[i].content);
            sb_str(&b, "<|eot_id|>");
        }
        if (add_generation_prompt)
            sb_str(&b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
        break;
    case ENG_CHAT_LLAMA2:
    case ENG_CHAT_MISTRAL: {
        /* user/assistant must alternate after an optional system turn */
        size_t first = n && !strcmp(msgs[0].role, "system") ? 1 : 0;
        bool llama2 = chat->kind == ENG_CHAT_LLAMA2;
        if (!llama2 && first) {
            free(b.s);
            return td_error(TD_ERR_INVALID_ARG, "chat: messages[0] is a system turn, which the mistral template "
                            "does not take");
        }
        if (!llama2 && n)
            sb_str(&b, chat->bos); /* Mistral: one BOS for the whole conversation */
        for (size_t i = first; i < n; i++) {
            const char *want = (i - first) % 2 == 0 ? "user" : "assistant";
            if (strcmp(msgs[i].role, want)) {
                free(b.s);
                return td_error(TD_ERR_INVALID_ARG, "chat: messages[%zu] is %s; %s needs user and assistant turns "
                                "to alternate", i, msgs[i].role, eng_chat_kind_name(chat->kind));
            }
            if (!strcmp(want, "user")) {
                if (llama2) {
                    /* bos + '[INST] ' + (<<SYS>> block + content).strip() + ' [/INST]' */
                    sbuf_t c = {0};
                    sb_add(&c, "", 0);
                    if (i == first && first) {
                        sb_str(&c, "<<SYS>>\n");
                        sb_str(&c, msgs[0].content);
                        sb_str(&c, "\n<</SYS>>\n\n");
                    }
                    sb_str(&c, msgs[i].content);
                    sb_str(&b, chat->bos);
                    sb_str(&b, "[INST] ");
                    if (c.oom)
                        b.oom = true;
                    else
                        sb_trimmed(&b, c.s);
                    free(c.s);
                } else {
                    sb_str(&b, "[INST] ");
                    sb_str(&b, msgs[i].content);
                }
                sb_str(&b, " [/INST]");
            } else if (llama2) {
                sb_str(&b, " ");
                sb_trimmed(&b, msgs[i].content);
                sb_str(&b, " ");
                sb_str(&b, chat->eos);
            } else {
                sb_str(&b, msgs[i].content);
                sb_str(&b, chat->eos);
            }
        }
        break;
    }
    }
    if (b.oom) {
        free(b.s);
        return td_error(TD_ERR_NO_MEMORY, "chat: no memory");
    }
    *out = b.s;
    return TD_OK;
}
